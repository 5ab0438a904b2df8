"""Embeddings and rerank: OpenAI's /v1/embeddings, the Jina/Cohere-shaped
/v1/rerank, and Ollama's /api/embed and /api/embeddings over the same work.

Owns these request and response shapes; serving/vectors.py runs a request
(admission, quotas, metrics) and engines/embedding/ computes. May import
what gateway/api/ may (serving/, access/, config.py, errors.py, engines/'
types). See docs/DESIGN.md, "Embeddings and rerank".
"""
