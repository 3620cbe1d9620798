"""The package list, found (pyproject.toml holds everything else): every `finetune*` package under finetune/, and the
Hydra config root recipes/ (at the top of the repository, where users and docs point) installed as `finetune.recipes`."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["finetune", "finetune.*"]), "finetune.recipes"])
