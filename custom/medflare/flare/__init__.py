"""Thin NVIDIA FLARE adapters: executor, aggregator, controller, initial model, persistor. No algorithm math here.

Every class a job names lives here, with no side effects when a job constructs it: sites allow-list these components
by exact path (:mod:`medflare.console.deploy.policies`); :mod:`medflare.console.job_export` writes the job folders.
"""
