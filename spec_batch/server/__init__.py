"""The OpenAI-compatible HTTP server (`spec-batch serve`, docs/server.md): online chat and completions on one
continuous-batching engine, and the Files and Batches API on the job store and the queue."""
