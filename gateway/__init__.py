"""The OpenAI-compatible gateway: HTTP in, Redis work queue out, tokens streamed back."""
