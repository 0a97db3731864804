from pathlib import Path

from setuptools import find_packages, setup

# The example configs and the Horovod build recipe ship inside the package (`--config digits.yaml`
# and `hvdtrain build-horovod` work from any folder), from where they live in the checkout. The
# images install dependencies from setup.py before these folders are copied in: then they are left out.
SHIPPED = {name: folder for name, folder in (("hvdtrain.configs", "configs"), ("hvdtrain.install", "scripts"))
           if (Path(__file__).parent / folder / "__init__.py").is_file()}

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Horovod-based data-parallel training toolkit for PyTorch",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]) + list(SHIPPED),
    package_dir=SHIPPED,
    package_data={"hvdtrain.configs": ["*.yaml"], "hvdtrain.install": ["install.sh", "*.patch"]},
    python_requires=">=3.10",
    # torch: the range we test; install it first (pip would otherwise pick PyPI's CUDA build, GBs).
    # Horovod is not declared: pip would build 0.28.1 in isolation, without torch and as C++14,
    # which PyTorch >= 2.1 rejects. `hvdtrain build-horovod` (or scripts/install.sh) builds it
    # with the project's patches against the torch already installed.
    install_requires=[
        "torch>=2.1,<2.15",
        "numpy>=1.26",
        "scikit-learn>=1.3",
        "mnist1d>=0.0.2",
        "tqdm>=4.66",
        "tensorboard>=2.14",
        "matplotlib>=3.8",
        "pyyaml>=6.0",
        "tomli>=2.0; python_version < '3.11'",
    ],
    # log.mlflow: MLflow's client and what its default SQLite store needs (or the full `mlflow`).
    extras_require={"mlflow": ["mlflow-skinny>=3.0", "sqlalchemy>=2.0", "alembic>=1.13"]},
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.tools.cli:main"]},
)
