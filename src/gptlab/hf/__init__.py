"""The Hugging Face bridge: `hf` (GPT-2 folders in Hugging Face's layout <-> gptlab runs: import, export, the
weights `--init-from` starts from) and `hf_tokenizer` (tokenizers in Hugging Face's formats, both ways). Only the
CLI's import / export verbs, the run policy (runs.py: `--init-from`) and the bench wing import it; import the
modules themselves, this file imports nothing.
"""
