"""A worked fine-tuning example on built-in data (docs/finetuning.md): `make finetune`."""
