"""The link to the model service(s): the engine client, the engine loop, replicas behind a router,
and the router's scorers.
"""
