"""llm-gateway: an LLM-aware HTTP gateway for one-engine-per-GPU replicas."""

__version__ = "0.1.0"
