"""Thin NVIDIA FLARE adapters: executor, aggregator, controller, initial model, persistor. No algorithm math here.

Every class a job names lives here, and nothing here may have side effects when a job constructs it: sites
allow-list these components by exact path (:mod:`medflare.deploy.policies`). Job folders are written by
:mod:`medflare.job_export`.
"""
