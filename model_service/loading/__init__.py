"""Checkpoints into a LoadedModel: GGUF files, Hugging Face folders, weight sources, the model
build."""
