"""Multi-LoRA's adapter term ``y[t] = (x[t] A[s_t]^T) B[s_t]^T`` for a ragged batch whose tokens use different
adapter slots (punica's bgmv): the jnp reference (gathers each token's tables) and the CPU kernel (reads them in
place)."""
