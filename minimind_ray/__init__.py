"""minimind-ray: MiniMind's training on Ray. docs/architecture.md is the map."""
from minimind_ray import ray_settings

ray_settings.apply()  # before any module of the package can import ray: Ray reads some settings at import
