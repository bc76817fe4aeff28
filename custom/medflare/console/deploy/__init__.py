"""Cross-hospital deployment: provisioning, site-local policies, POC runs, job templates, apps, multi-GPU sites.

Nothing here is needed to train; it turns the FLARE job that :mod:`medflare.console.job_export` writes into something a
consortium can provision, review and run. Every method in :func:`medflare.registry.list_methods` is covered
without naming any method.
"""
