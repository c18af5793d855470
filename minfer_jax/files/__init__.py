"""What comes from files: GGUF parsing and validation, the tokenizer and chat template built from
its metadata, where a model file comes from (local, built-in, hub), and synthetic GGUFs of real
shapes."""
