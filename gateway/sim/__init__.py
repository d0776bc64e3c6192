"""Simulated GPU engine replicas (``llm-gateway sim``): vLLM, TGI, SGLang and llama.cpp on the
wire, with a continuous-batching timing model of one GPU. See ``README.md`` here."""
