"""Training data: sources (files of documents), the sharded token store, mixtures and their order.

sources.py   a source string -> files -> work units -> documents (text, JSONL, Parquet, HF datasets)
store.py     documents -> a folder of token shards + document index, built in parallel, checked by sha256
mixture.py   several stores with weights -> which source each sample of a step comes from
sampler.py   the order of sequences: a shuffled epoch over each store, or random windows
chat.py      instruction data: conversations rendered with the model's chat template, a loss mask per token
"""
