"""Past one box (`--replicas N`): engine replicas as Ray actors behind one Engine (router.py)."""
