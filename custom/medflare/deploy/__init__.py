"""What a provisioned site's FLARE runs from deployment: the update filters a site's privacy policy names by class path
(``medflare.deploy.filters``). The deployment tools themselves are in :mod:`medflare.console.deploy`.
"""
