"""DeepSpeed ZeRO-1/2/3 adapters: config section, initialize/patch, and one module per ZeRO stage family."""
