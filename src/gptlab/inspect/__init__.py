"""Looking inside a trained GPT: `trace` (attention probabilities, the residual stream, the logit lens), the
architecture with its parameter counts (`anatomy`), and the pictures and pages made from them (`pictures`, `page`).
Only the CLI imports this package; nothing in it changes or slows the model's own forward."""
