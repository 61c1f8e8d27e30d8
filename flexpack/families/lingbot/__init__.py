"""LeRobot's LingBot-VA (lingbot-va) on the Wan backbone: model, config, objective, sampler, mask, exports."""
