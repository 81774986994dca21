"""The shop app: accounts and the payments charged against them."""

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.django_project.shop"
    label = "shop"
