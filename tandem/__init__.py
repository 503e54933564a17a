"""Tandem: serve LLMs on Kubernetes with prefill and decode split across pods.

Everything imports under this one namespace; pyproject.toml maps the
top-level folders into it (`tandem.engine` is `engine_image/engine/`).
"""

__version__ = "0.1.0"
