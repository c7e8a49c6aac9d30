"""Single-device Llama-style transformer (dense and MoE), its arguments and presets.

Import from the modules: `args` and `presets` are free of torch (the CLI reads them before a run
starts), `transformer` and `decode` are the modules that need it.
"""
