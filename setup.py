from setuptools import Extension, find_packages, setup

setup(
    name="parallax_tf",
    version="0.1.0",
    description="Distributed training for single-device tf.compat.v1 graphs (Parallax and kin)",
    packages=find_packages(include=["parallax_tf", "parallax_tf.*", "rewriters", "models", "tools"]),
    python_requires=">=3.10",
    install_requires=["tensorflow-cpu==2.21.*", "absl-py", "numpy"],
    # Native pieces. The bind shim is preloaded into ranks (not imported) so TF's servers listen
    # on the launcher's address only; see parallax_tf/runtime/bind.py.
    ext_modules=[Extension("parallax_tf._bindshim", ["parallax_tf/native/bind_shim.c"], libraries=["dl"])],
)
