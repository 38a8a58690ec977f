"""Past one box (`--replicas N`): engine replicas as Ray actors behind one Engine (router.py), and
the trainer as one more actor (trainer_actor.py; its daemon side, remote_trainer.py)."""
