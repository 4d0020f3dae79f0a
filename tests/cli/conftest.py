from tests.server.conftest import tiny_folder  # noqa: F401 (the tiny Llama with a tokenizer, as the server tests use)
