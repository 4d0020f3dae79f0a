"""Benchmarks that ship with the package (``jaxllm bench ...``), usable against any OpenAI-compatible server:
`jaxllm.bench.datasets` makes the requests, `jaxllm.bench.serve` sends them and measures, as ``vllm bench serve``
does (its flags, its metric names, its result file)."""
