from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Horovod-based data-parallel training toolkit for PyTorch",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    python_requires=">=3.10",
    # torch and horovod are installed by scripts/install.sh (Horovod 0.28.1 needs a patched build
    # against PyTorch >= 2.1), so they are declared with the ranges we test, not fetched here.
    install_requires=[
        "torch>=2.1,<2.15",
        "horovod==0.28.1",
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
