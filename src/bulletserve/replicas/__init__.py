"""Data-parallel replicas: N engines, each on its own device(s), behind one OpenAI endpoint.
router.py decides where a request goes (pure); ray_replicas.py runs the engines as Ray actors
and carries the decisions out."""
