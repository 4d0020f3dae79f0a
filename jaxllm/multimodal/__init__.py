"""Images for vision-language models: decoding and preprocessing (numpy and Pillow, no torch)."""
