"""The llama.cpp bridge: `vocab` (gptlab's tokenizers as a GGUF file's vocabulary, both ways), `gguf_out` (a run as a
GGUF file llama.cpp runs: `gptlab export --format gguf`), `gguf_in` (a GPT-2-architecture GGUF file as a run:
`gptlab import gguf`) and `peer` (llama.cpp itself, through llama-cpp-python, for the peer tests and `gptlab bench
generate --peer llama.cpp`). Only the CLI's import / export verbs and the bench wing import it; import the modules
themselves, this file imports nothing.
"""
