"""The console: what a person runs on their own machine (the command line, the simulator wrapper, the job writer,
reports, predictions, scenarios, the deployment tools). Nothing in a FLARE job's processes imports it; a BYOC job and
the site wheel ship the package without it (issue 64).
"""
