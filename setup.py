from setuptools import find_packages, setup

setup(
    name="parallax_tf",
    version="0.1.0",
    description="Distributed training for single-device tf.compat.v1 graphs (Parallax and kin)",
    packages=find_packages(include=["parallax_tf", "parallax_tf.*", "rewriters", "models", "tools"]),
    python_requires=">=3.10",
    install_requires=["tensorflow-cpu==2.21.*", "absl-py", "numpy"],
)
