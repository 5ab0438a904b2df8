"""Vectors and relevance scores from an MLX model, beside its decoding.

An embedding model (Qwen3-Embedding's layout: a decoder saved without its
head, sentence-transformers' `modules.json` naming its pooling) answers
`/v1/embeddings`; a reranker (Qwen3-Reranker's layout: a causal LM asked
"yes" or "no") answers `/v1/rerank`. pooling.py and rerank.py are plain
functions (how a checkpoint pools, how hidden states become vectors, how a
pair becomes a prompt and a score); embedder.py runs them on the model's
weights from a worker thread of its own, taking the model's lock around
each forward as the decoding engines do. May import engines/ (its types,
loading, cpu workers); see docs/DESIGN.md, "Embeddings and rerank".
"""
