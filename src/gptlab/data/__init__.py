"""The data stage: text in, token files out, batches drawn from them.

`corpus` (where text comes from and the one rule for reading it), `readers` (documents out of text, JSON-lines and
Parquet sources, and the scan that counts them), `encoder` (text pieces -> token ids in worker processes, in
order), `tokenfiles` (token files and a split's shards, read as one memory-mapped stream), `staging` (prepare's
staging folder and its checkpoints: what makes an interrupted prepare resumable), `prepare` (the pipeline: text ->
train / val shards + meta.json) and `batches` (a prepared folder loaded, and reproducible (x, y) windows drawn from
it). Nothing here imports the model or the training stage; import the modules themselves, this file imports
nothing.
"""
