"""Run state: from training/ only config, checks, parallel and runstate/; never observe/, flow/ or drivers."""
