import glob

from setuptools import Extension, find_packages, setup


def _ops_extension() -> Extension:
    """The toolkit's compiled TF ops, built against the installed TensorFlow with its own flags
    (C++17 and the C++11 ABI come from tf.sysconfig and must not be overridden; see BUILD.md)."""
    import tensorflow as tf
    return Extension("parallax_tf._parallax_ops", sorted(glob.glob("parallax_tf/ops/*.cc")), language="c++",
                     include_dirs=["."], depends=sorted(glob.glob("parallax_tf/ops/*.h")),
                     extra_compile_args=tf.sysconfig.get_compile_flags() + ["-O3", "-fPIC"],
                     extra_link_args=tf.sysconfig.get_link_flags())


setup(
    name="parallax_tf",
    version="0.1.0",
    description="Distributed training for single-device tf.compat.v1 graphs (Parallax and kin)",
    packages=find_packages(include=["parallax_tf", "parallax_tf.*", "rewriters", "rewriters.*", "models", "tools"]),
    python_requires=">=3.10",
    # TensorFlow for the CPU or with CUDA: `pip install .[cpu]` or `.[gpu]` (tools/setup.sh picks
    # by nvidia-smi, PARALLAX_DEVICE forces it); both provide the `tensorflow` module.
    install_requires=["absl-py", "numpy"],
    extras_require={"cpu": ["tensorflow-cpu==2.21.*"], "gpu": ["tensorflow[and-cuda]==2.21.*"]},
    # Native pieces. The bind shim is preloaded into ranks (not imported) so TF's servers listen
    # on the launcher's address only; see parallax_tf/runtime/bind.py.
    # The compiled ops: significance selection (Slim-DP), staleness-scaled async apply (PS+),
    # input stash (DSP), flat scatter (Slim-DP's pulls), per-id uniforms (dynamic tables); see
    # parallax_tf/ops/.
    ext_modules=[Extension("parallax_tf._bindshim", ["parallax_tf/native/bind_shim.c"], libraries=["dl"]),
                 _ops_extension()],
)
