# Stand-in for IPython (not installed here): SGLang imports IPython.display only for notebook helpers.
