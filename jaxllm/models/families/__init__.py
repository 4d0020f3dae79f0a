"""One module per model family, each defining `SPEC` (a `jaxllm.models.family.FamilySpec`); the registry lists
them."""
