"""Looking inside a trained GPT: `trace` (attention probabilities, the residual stream, the logit lens), the
architecture with its parameter counts (`anatomy`), and the pictures and pages made from them (`pictures`, `page`).
The CLI (`gptlab inspect`), the server's /inspect route (serve/app.py) and `gptlab bench train --traced` import it;
nothing in it changes or slows the model's own forward."""
