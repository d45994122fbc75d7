"""Package build: the gRPC stubs are generated from proto/ before the modules are collected."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self):
        runpy.run_path(str(HERE / "proto" / "generate.py"))["generate_stubs"]()
        super().run()


setup(
    packages=find_packages("services"),
    cmdclass={"build_py": BuildPyWithStubs},
)
