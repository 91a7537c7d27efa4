"""Adapters that plug kvtier into inference engines: an SGLang HiCache storage backend
(:mod:`kvtier.client.adapters.sglang`) and a vLLM KV connector
(:mod:`kvtier.client.adapters.vllm`), and the link to kvtierd both keep
(:mod:`kvtier.client.adapters.daemon_link`)."""
