"""Random-weight Hugging Face checkpoints with a trained BPE tokenizer, and the model cache
(`pdscope make-model`; the embedded server's built-in models)."""
