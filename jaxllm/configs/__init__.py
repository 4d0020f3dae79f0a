"""Engine presets (TOML), read with importlib.resources so an installed wheel carries them."""
