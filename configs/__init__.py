"""Example configs, shipped in the package as hvdtrain.configs (setup.py): `--config digits.yaml` works anywhere."""
