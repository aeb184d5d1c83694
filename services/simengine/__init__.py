"""QuillCache sim engine: a stand-in for vLLM for tests, demos and benchmarks."""
