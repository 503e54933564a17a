"""The Tandem operator: ModelDeployment custom resources into prefill and decode engine pods."""
