"""``policy_server.v1`` on Ray Serve: replicas (one engine, one GPU each) behind Serve's gRPC proxy, with strict
session affinity.

- ``app.build_app``: the Serve application (``import_path: policy_server.ray_serve:build_app``);
- ``deployment.PolicyDeployment``: one replica;
- ``call.ServeCall``: what the servicer sees of a call that came through the proxy;
- ``command``: ``policy-server ray-serve``, the application on a local or running Ray cluster.

Needs Ray Serve (``pip install 'policy-server[ray]'``); nothing else in the package imports this one.
"""

from policy_server.ray_serve.app import APPLICATION, build_app, grpc_options

__all__ = ["APPLICATION", "build_app", "grpc_options"]
