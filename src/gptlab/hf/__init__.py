"""The Hugging Face bridge: `gpt2_folders` (GPT-2 folders in Hugging Face's layout <-> gptlab runs: import,
export, the weights `--init-from` starts from), `peft` (LoRA adapters in PEFT's format, both ways) and `hf_tokenizer` (tokenizers in Hugging Face's formats, both ways). Only the
CLI's import / export verbs, the run policy (runs.py: `--init-from`) and the bench wing import it; import the
modules themselves, this file imports nothing.
"""
