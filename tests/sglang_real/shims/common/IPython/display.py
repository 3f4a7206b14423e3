# Stand-in for IPython.display: SGLang's notebook helpers import these names; never called in tests.
def display(*objects, **kwargs):
    for obj in objects:
        print(obj)


class HTML:
    def __init__(self, data=None, **kwargs):
        self.data = data


class Markdown(HTML):
    pass


class Image(HTML):
    pass
