"""hpc_radix: a hybrid prefix cache for SGLang."""
