from trainer.cli import entry

raise SystemExit(entry())
