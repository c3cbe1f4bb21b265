"""The fleet in simulation (`loraplex simulate`): the production routing, placement and
admission code driving modelled workers in virtual time. Layers, imported only downward:
profile (step costs) and workload (scenario, requests); replica (a worker's batching);
routers; fleet (the event loop); report; cli."""
