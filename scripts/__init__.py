"""Shipped in the package as hvdtrain.install (setup.py): install.sh, for `hvdtrain build-horovod`."""
